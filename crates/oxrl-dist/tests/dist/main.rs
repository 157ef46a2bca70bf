//! oxrl-dist's integration tests as one binary: the store (oxrl's client and server, and both
//! against torch's TCPStore) and the TCP ring's collectives between real sockets.

mod ring;
mod store;
mod torch_store;
