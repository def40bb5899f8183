"""The prepared GPU check (``scripts/test.sh gpu``): plain scripts, not pytest tests.

Nothing here is named ``test_*.py``, so the CI pytest run of ``tests`` never collects it;
tests/unit/test_gpu_check_harness.py runs it with the CPU stand-in instead.
"""
