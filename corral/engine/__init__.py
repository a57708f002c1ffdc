"""The inference engine: model, paged KV cache, scheduler, sampler and the step loop."""
