"""Prompts and images for GRPO on a vision-language model, rendered as EasyR1 renders them.

One rendering path for every stage, the one EasyR1's RLHFDataset uses: the Jinja format prompt is
applied to the problem, the text is split on "<image>" into image and text content parts, the
processor's chat template renders them with the generation prompt, and each image is sized by
EasyR1's rule (`images.model_image_size`). `filtering.filter_split` does this once per split and
stores prompt + sized images, so the trainer and the evaluator read the filtered parquet
(`filtering.load_filtered` + `prompts.encode_prompts`) and never render or resize again.

Modules: `sources` (rows from a hub id or parquet, json, jsonl or csv files; the model's processor), `images` (sizing,
decoding), `videos` (frames sampled and sized by qwen-vl-utils, as EasyR1 reads video rows), `prompts` (format template, chat rendering, token counts, model inputs), `filtering`
(the filter stage, its stats and the reader of its output).
"""
