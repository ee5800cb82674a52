"""Planning: which symbols of a trace may be captured (``safety``), how the trace is cut into regions (``regions``),
and which inputs of each region are static (``static_inputs``). Runs when Thunder compiles; nothing here runs per
call."""
