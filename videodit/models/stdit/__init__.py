"""STDiT, the spatial-temporal DiT of Open-Sora 1.2 (STDiT3), with Open-Sora 1.2's weight
layouts and VAE. The rest of videodit reaches it through ``spec.StditSpec`` only."""
