"""sa_cp."""
