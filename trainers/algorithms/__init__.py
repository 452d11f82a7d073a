"""One file per algorithm (its objective and trainer class) with its config beside it, and the pieces several share: the reference model and its synchronization, the entropy bonus."""
