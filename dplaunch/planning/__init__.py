"""Pure, torch-free layout maths: the parallel layout and its rules, the plan, memory, traffic and
the step forecast. No data code (dplaunch/data/), no device probes (dplaunch/launching/)."""
