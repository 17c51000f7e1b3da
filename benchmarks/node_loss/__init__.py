"""Node loss on the local Slurm cluster's namespaced nodes: from a node's death to the trial's next step."""
