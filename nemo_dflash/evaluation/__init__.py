"""Evaluation: what a figure of a trained draft means and how it is taken. The protocol (`protocol`: prompt
sets, conversations decoded turn by turn, tau and the loop-aware metrics, each result carrying its
`EvalProtocol`), one run of it with its journals and the speedup phase (`run`), the acceptance measured by
replaying answers through the training forward (`replay`), and the check that the eager decoder and a
serving engine agree token for token (`parity`). It decodes on `engine/` and never imports `serving/`.
"""
