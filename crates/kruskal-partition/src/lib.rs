//! Load-balanced partitioning for kruskal (in progress).
