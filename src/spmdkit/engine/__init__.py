"""spmdkit.engine: op-independent propagation machinery: the notation and its typed policy
(notation), the compiled plans and their reference (compiler, merge), rules as declarations
(declare, shapes, signature), the rule table and its result cache (registry, cache_keys, memo),
the view algebra (dim_trans, axes), generated code (codegen) and the op facts table (facts)."""
