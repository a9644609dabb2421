"""The codelab's demonstrations: the gradient check, dispatch vs jit, float32 vs bfloat16,
tokens/sec, the pure-PyTree twin, the benchmark and profiling.

Nothing outside this folder imports it; a project deletes it (with what the README lists) and
keeps a working trainer.
"""
