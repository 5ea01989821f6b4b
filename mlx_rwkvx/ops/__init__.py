"""Pure differentiable functions (WKV7, MoBA attention, head + loss) and their kernel builders."""
