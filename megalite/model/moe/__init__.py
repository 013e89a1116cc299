"""The Mixture-of-Experts layer the families share (ARCHITECTURE.md section 15; docs/moe.md):
the router (`router`: softmax or sigmoid scores in fp32, top-k with or without renormalising,
a selection-only bias, group-limited choice), the experts (`experts`: stacked SwiGLU weights
[E, ...], dropless or with a capacity, grouped GEMM or a per-expert loop), the layer with its
shared experts (`layer`), the balancing losses and the routing figures of a stage (`balance`,
`ledger`) and the once-a-step bias update and figures (`step`). A family (`megalite.model.
mixtral`) says which blocks have one and builds it from `model.moe`."""
