"""The control plane: etcd client and keys, typed records, the cluster view, membership, election, the leader."""
