"""Fault injection for the real-vLLM tests, off unless ``$PDXFER_TEST_HOOKS_DIR`` is set: the
success path calls one hook function and never branches on test state itself.
"""
