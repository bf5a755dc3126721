"""Memory and communication planning: what each sync mode holds and measured bytes (``accounting``), the
collectives a step should issue (``schedule``), the alpha-beta cost model (``costs``) and its calibration
(``calibrate``), activation estimates (``activations``), which units to defer (``units``), ``auto``'s
choice (``autosync``) and the planner behind ``syncwise plan`` (``plan``).

Layer: above ``data``, ``models``, ``config``, ``sync`` and ``runtime``; below ``losses`` and ``engine``."""
