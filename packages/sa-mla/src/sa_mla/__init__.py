"""sa_mla: see the package README."""

__all__: list[str] = []
