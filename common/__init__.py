"""The lowest layer: small pieces every runtime package may use, importing none of them.

Only what more than one package needs and that belongs to none of them lives here (the
circuit breaker, the metrics helper); ``tests/unit/test_layers.py`` keeps it at the bottom.
"""
