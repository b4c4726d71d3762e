"""Graded exercises: authoring (`release`), learner checks (`lab.check`), class grading (`grade`).

Student code never runs in the process that decides scores: each exercise's cells run in a sandboxed
subprocess (`sandbox`), checks written as ordinary Python (`checks/`) call into it with inputs they choose
and compare the plain values that come back (`runner`). See course/instructor-guide.md for the workflow.
"""

from lab.grading.checks import CheckFailed, Exercise, exercise, expect_close, expect_equal
from lab.grading.learner import Report, check
from lab.grading.runner import ExerciseResult, StudentResult, run_exercise
from lab.grading.sandbox import Limits, Sandbox

__all__ = ["CheckFailed", "Exercise", "ExerciseResult", "Limits", "Report", "Sandbox", "StudentResult", "check",
           "exercise", "expect_close", "expect_equal", "run_exercise"]
