"""Tuned kernel configurations (JSON), installed as ``ep_dispatcher.configs``; see ``ep_dispatcher.config``."""
