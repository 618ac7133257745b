"""Backends behind ``Buffer``: ``reference`` (pure PyTorch) and ``cuda`` (the ``ep_dispatcher._C`` engine)."""
