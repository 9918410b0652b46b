"""Sluice's benchmark suite: ``python -m bench NAME [options]`` (see ``bench/__main__.py``)."""
