# GRPO benchmark (filled in by the GPU issue)
