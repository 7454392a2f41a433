"""Generation and environments: the embedded engine, the SGLang-protocol server, SGLang launcher, client and router."""
