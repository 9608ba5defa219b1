"""spmdkit.engine: op-independent propagation machinery: the notation and its typed policy
(notation), the compiled plans, their fast path and their reference (plans, compiler, fastpath,
merge), the call's tensors and the answer's attrs (tensors), rules as declarations
(declare, shapes, signature), the rule table and its result cache (registry, cache_keys, memo),
the view algebra (dim_trans, axes), generated code (codegen) and the op facts table (facts)."""
