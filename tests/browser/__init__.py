"""Real-browser tests of the course notebooks and widgets (JupyterLab + headless Chromium)."""
