"""sa_layers: see the package README."""

__all__: list[str] = []
