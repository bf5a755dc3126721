"""The sync core: the table of sync modes (``modes``), applying and restoring their FSDP switches around a
micro-batch (``switches``), counting the collectives a step issued (``counting``), and the only module
that reads FSDP's private state (``fsdp_internals``).

Layer: imports only ``runtime`` (and torch); everything above may import it."""
