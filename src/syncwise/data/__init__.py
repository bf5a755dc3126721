"""Data on its way to the model: micro-batches, caps, balance and order restored (``batching``), sequence
packing (``packing``), variable-length attention for packed rows (``attention``).

Layer: above ``models``, ``config``, ``sync`` and ``runtime``; imports none of them today."""
