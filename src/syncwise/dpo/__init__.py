"""`syncwise dpo`: preference optimisation (DPO, IPO, hinge, robust, SimPO) on TRL's preference data."""
