"""Lightricks' LTX-2 (2.0 and 2.3): the audio+video DiT, its released weight layouts and its spec.

``geometry.py`` the model's arguments, ``rope.py`` its per-head RoPE, ``attention.py``,
``embeddings.py`` and ``block.py`` the layers, ``model.py`` the DiT, ``release_config.py`` the
release's and diffusers' configurations, ``layouts.py`` the weight files, ``spec.py`` the family.
"""
