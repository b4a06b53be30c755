"""sa_routing: see the package README."""

__all__: list[str] = []
