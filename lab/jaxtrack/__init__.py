"""The JAX track: each chapter's idea written the JAX way, on simulated CPU devices (`lab.jaxtrack.sim`).

One short module per chapter, each checked by a test against `lab`'s PyTorch result for the same inputs. Nothing
in `lab` imports this package: JAX is an optional extra (`pip install -e '.[jax]'`).
"""
