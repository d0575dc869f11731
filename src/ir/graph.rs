//! The dataflow graph: petgraph `StableDiGraph` with one node per value-producing op and
//! edges labelled by input slot.

use super::layout::Layout;
use super::op::Op;
use super::tensor::{DType, Name, TensorFact};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};
use petgraph::Direction;
use smallvec::SmallVec;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub type NodeId = NodeIndex<u32>;

#[derive(Debug, Clone)]
pub struct Node {
    /// Unique, human-readable name (checkpoint tensor name for params).
    pub name: Name,
    pub op: Op,
    /// Facts of the op's output.
    pub fact: TensorFact,
    /// The decoder layer this node belongs to, if any.
    pub layer: Option<u32>,
    /// Sort key that keeps printed programs in source order; inserted nodes sit right after
    /// their producer.
    pub order: u64,
    /// Set by layout assignment.
    pub layout: Option<Layout>,
}

/// An edge feeds the producer's output into input `slot` of the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edge {
    pub slot: u32,
}

#[derive(Debug, Clone)]
pub struct Graph {
    pub name: String,
    pub dtype: DType,
    pub g: StableDiGraph<Node, Edge, u32>,
}

/// Spacing of `order` keys so passes can insert nodes between neighbours.
pub const ORDER_STEP: u64 = 1 << 16;

impl Graph {
    pub fn new(name: impl Into<String>, dtype: DType) -> Graph {
        Graph {
            name: name.into(),
            dtype,
            g: StableDiGraph::default(),
        }
    }

    pub fn add(&mut self, node: Node, inputs: &[NodeId]) -> NodeId {
        let id = self.g.add_node(node);
        for (slot, &src) in inputs.iter().enumerate() {
            self.g.add_edge(src, id, Edge { slot: slot as u32 });
        }
        id
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id]
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.g[id]
    }

    /// Inputs ordered by slot.
    pub fn inputs(&self, id: NodeId) -> SmallVec<[NodeId; 4]> {
        let mut v: SmallVec<[(u32, NodeId); 4]> = self
            .g
            .edges_directed(id, Direction::Incoming)
            .map(|e| (e.weight().slot, e.source()))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, n)| n).collect()
    }

    /// Consumers with the slot they read this value into, in a stable order.
    pub fn users(&self, id: NodeId) -> Vec<(NodeId, u32)> {
        let mut v: Vec<(NodeId, u32)> = self
            .g
            .edges_directed(id, Direction::Outgoing)
            .map(|e| (e.target(), e.weight().slot))
            .collect();
        v.sort_unstable_by_key(|(n, s)| (self.g[*n].order, *s));
        v
    }

    /// Points input `slot` of `consumer` at `new_src` instead of its current producer.
    pub fn rewire(&mut self, consumer: NodeId, slot: u32, new_src: NodeId) {
        let old: Vec<_> = self
            .g
            .edges_directed(consumer, Direction::Incoming)
            .filter(|e| e.weight().slot == slot)
            .map(|e| e.id())
            .collect();
        for e in old {
            self.g.remove_edge(e);
        }
        self.g.add_edge(new_src, consumer, Edge { slot });
    }

    /// Nodes in dependency order, ties broken by `order` so output is deterministic and
    /// follows the source. Returns the nodes on a cycle as the error.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, Vec<NodeId>> {
        // Fast path: builders and passes give every node an `order` after its inputs', so
        // sorting by it is usually already a topological order; checking that is linear.
        let mut sorted: Vec<NodeId> = self.g.node_indices().collect();
        sorted.sort_unstable_by_key(|&n| (self.g[n].order, n.index()));
        let mut position = vec![0u32; self.g.node_bound()];
        for (i, &n) in sorted.iter().enumerate() {
            position[n.index()] = i as u32;
        }
        if self
            .g
            .edge_references()
            .all(|e| position[e.source().index()] < position[e.target().index()])
        {
            return Ok(sorted);
        }
        self.kahn_order()
    }

    /// Kahn's algorithm with ties broken by `order`.
    fn kahn_order(&self) -> Result<Vec<NodeId>, Vec<NodeId>> {
        let mut indegree: Vec<u32> = vec![0; self.g.node_bound()];
        for e in self.g.edge_references() {
            indegree[e.target().index()] += 1;
        }
        let mut ready: BinaryHeap<Reverse<(u64, u32)>> = self
            .g
            .node_indices()
            .filter(|n| indegree[n.index()] == 0)
            .map(|n| Reverse((self.g[n].order, n.index() as u32)))
            .collect();
        let mut out = Vec::with_capacity(self.g.node_count());
        while let Some(Reverse((_, i))) = ready.pop() {
            let n = NodeId::new(i as usize);
            out.push(n);
            for e in self.g.edges_directed(n, Direction::Outgoing) {
                let t = e.target();
                indegree[t.index()] -= 1;
                if indegree[t.index()] == 0 {
                    ready.push(Reverse((self.g[t].order, t.index() as u32)));
                }
            }
        }
        if out.len() == self.g.node_count() {
            Ok(out)
        } else {
            Err(self
                .g
                .node_indices()
                .filter(|n| indegree[n.index()] > 0)
                .collect())
        }
    }

    pub fn find(&self, name: &str) -> Option<NodeId> {
        self.g.node_indices().find(|&n| &*self.g[n].name == name)
    }

    pub fn layout(&self, id: NodeId) -> Layout {
        self.g[id].layout.unwrap_or(Layout::Replicated)
    }
}
