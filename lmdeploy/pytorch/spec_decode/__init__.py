"""Speculative decoding: draft tokens cheaply, verify them with the target model in one forward.

One decode step with drafts (docs/en/advance/spec_decoding.md)::

    propose     n-gram lookup in the sequence's own tokens, or the model's MTP head     (drafter)
    schedule    the decode chunk carries K drafts; KV slots for them are taken if free  (scheduler)
    snapshot    hybrid models: runtime state slot → the sequence's scratch slot         (decoder)
    forward     last token + K drafts scored as one chunk of the sequence               (model runner)
    accept      greedy exact match / speculative sampling, + one target token          (acceptance)
    roll back   all kept: state is at the last accepted token; otherwise restore the
                snapshot and recompute the accepted tokens in the next forward          (decoder)

Modules: :mod:`.ngram` (prompt lookup), :mod:`.mtp` (the MTP head), :mod:`.acceptance`
(greedy and rejection-sampling acceptance), :mod:`.decoder` (the engine-side steps),
:mod:`.strategy` (what a decoding method requires of the planner: lookahead ℓ, recompute r).
"""
