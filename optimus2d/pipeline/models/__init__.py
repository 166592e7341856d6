"""Models cut into pipeline stages: LLaMA-shaped causal LMs (``llama.py``), GPT-2 with its tied
table on the first and last stages (``gpt2.py``), LLaVA's encoder and text stages (``llava.py``).
Each registers its stage classes with ``convert.register_converter`` when imported."""
