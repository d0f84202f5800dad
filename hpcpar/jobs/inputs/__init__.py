"""What every job reads and how it opens its stage, shared by generation, scoring and
training (which never import each other): the prompts and their checks (``prompts``), a
prompt line's sampling settings (``sampling_settings``), the split of a batch over replicas
and micro-batches (``batching``), the prefill-and-decode forward schedule (``schedule``), and
the checkpoint's tokenizer and end-of-sequence ids and this rank's stage of the model
(``stage``)."""
