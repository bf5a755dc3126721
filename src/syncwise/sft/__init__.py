"""Supervised fine-tuning (`syncwise sft`): the job (``trainer``), what it trains on (``data``: a dataset or a
built-in task), and the built-in tasks (``tasks``: the progression demo, the GSM8K-shaped ``arith_chat``)."""
