"""sa_kernels: see the package README."""

__all__: list[str] = []
