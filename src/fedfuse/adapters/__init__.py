"""LoRA adapters as federated state: a frozen base LM (fedfuse ``transformer`` or a Hugging Face causal LM)
with ``peft`` LoRA modules whose tensors are the only thing clients train, send and the server fuses.

Modules: :mod:`~fedfuse.adapters.lora` (base loading, adapter tensors, ΔW view), :mod:`~fedfuse.adapters.text`
(character tokenizer, ``fedfuse pretrain``), :mod:`~fedfuse.adapters.evaluate` (token loss, generation,
ROUGE-1).  The LoRA algorithms' shared plumbing is :mod:`fedfuse.algorithms.lora_base`; corpora are read by
:mod:`fedfuse.data.corpus`.
Needs the ``lora`` extra: ``pip install 'fedfuse[lora]'``.
"""
