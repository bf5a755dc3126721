"""Jobs and the command line (the top layer): ``syncwise train / sft / bench / plan`` (``cli``), the checks
made before any rank starts (``preflight``), the SFT job (``sft``) and the benchmarks (``bench``,
``bench_rl``). May import every layer below; nothing imports it."""
