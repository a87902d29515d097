"""The simulator's side of the seam: hardware and model specs, a roofline cost model, a
simulated clock and an executor that charges time instead of running a model.

The simulator reuses the core unchanged (request tracker, scheduler policies, KV tier manager,
step loop); only the executor and the clock come from here.
"""
