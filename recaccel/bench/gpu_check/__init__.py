"""``make gpu-check``: the GPU tests, every benchmark at GPU sizes and the targets' summary in
one command (``python -m recaccel.bench.gpu_check``; :mod:`recaccel.bench.gpu_check.runner`)."""

__all__: list[str] = []
