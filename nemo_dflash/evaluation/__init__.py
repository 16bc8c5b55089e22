"""Evaluation: what a figure of a trained draft means and how it is taken. The protocol (`protocol`: prompt
sets, conversations decoded turn by turn, tau and the loop-aware metrics, each result carrying its
`EvalProtocol`), one run of it with its journals and the speedup phase (`run`), the acceptance measured by
replaying answers through the training forward (`replay`), and the check that the eager decoder and a
serving engine agree token for token (`parity`). The measurement rows the benchmarks write are built here too:
a run directory's drafter and arm rows (`run_rows`), regeneration's rows (`regen_rows`), the rows' files and
provenance (`rows`), the no-loop speedup figures (`loop_figures`). It decodes on `engine/` and never imports
`serving/`.
"""
