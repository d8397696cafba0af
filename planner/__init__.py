"""autopar.planner: cost and memory model and the PuLP search over plans (not written yet).

Today a plan is given by the user (`autopar.Plan`); stage boundaries are chosen by
`autopar.passes.split_stages` from the captured graph's per-node costs.
"""
