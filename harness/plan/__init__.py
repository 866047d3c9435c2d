"""Planning: what a run needs, counted before it starts. One job per module:

  traced_io       a graph's inputs and outputs as the graph defines them, on the meta device
  instances       the inf2 instances, the TP degrees a model allows, the fit of a core (port/core_fit.py)
  batch_fit       the KV slots of a batch beside the weights, by that fit (`info --batch`)
  memory          one chip's memory plan: the longest context that fits, the most sequences
  kv_fit          --kv-len against the chip and against this host's memory
  compile_budget  the builds a device command compiles and their cold-compile minutes
  host_plan       every command's resource plan (`info --plan`): host peak by phase, device, graphs
"""
