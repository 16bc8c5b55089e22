"""The training objective: what one step of the draft is asked to predict and how it is scored. Anchors and
the block inputs and labels built from them (`anchors`), the block attention mask (`block_mask`), the losses
(`cross_entropy`: chunked and fused CE with distillation against the target; `fused_loss`: the liger and
cut-cross-entropy kernels; `accept_loss`: the speculative-sampling accept probability; `selector_loss`:
DFlash2's candidate selector and D-PACE weights), what a step measures (`metrics`), and the trainer module that
runs the draft over a target batch and returns the loss's sums (`trainer_module`). `train/` drives it.
"""
