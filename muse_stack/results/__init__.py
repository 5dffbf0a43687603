"""What a finished run reports: results.json (measurement window, throughput, MFU, cost), its loss
and throughput plots, and the stack it ran on in the words of an OpenRecipes record."""
