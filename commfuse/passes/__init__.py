# FX-graph rewrites that run before lowering, one module per rewrite; fx_rewrite holds what they share.
