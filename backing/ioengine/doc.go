// Package ioengine reads byte ranges of backing (shard) files for the daemon
// with as few context switches and device kicks per read as it can.
//
// Why: on the 2-vCPU VMs engramfs runs on, a context switch and a virtio
// kick are the expensive part of a read, not the read. perf on the daemon
// (2026-12-01) put half of all samples in the hypervisor's irq-enable after a
// switch and 16% in the virtio kick; the daemon spent 90-275 µs of CPU per
// 4 KiB backing page where fio with io_uring at QD64 spends ~18 µs. A
// blocking pread per goroutine pays a sleep, a wake-up and a kick for every
// read.
//
// The io_uring engine instead has one reaper goroutine, locked to its thread,
// write many reads into the submission ring and submit them with the
// io_uring_enter it sleeps in until at least one read completes; it then
// takes every completion available in that wake-up, calls Done for each,
// refills the ring from its FIFO and submits the refill in its next enter.
// Other threads only queue reads, and wake a sleeping reaper through an
// eventfd it polls in the ring: a read's completion runs as task work on the
// thread that submitted it, and only the reaper's thread is sure never to
// sleep where task work cannot run (see uringEngine). The pread engine is the fallback where io_uring is refused
// (kernel.io_uring_disabled, seccomp, old kernels; a ring that sets up but
// cannot complete a NOP through io_uring_enter counts as refused): a fixed pool of
// queueDepth workers, so a burst of requests never becomes a burst of
// goroutines and blocked OS threads.
//
// Measured here (BenchmarkRandRead4K, random 4 KiB O_DIRECT reads of a 1 GiB
// file, 2026-12-01, on a machine shared with other builds, so rough): at
// QD64 io_uring did 73-108K IOPS at 3.3-4.8 µs of process CPU and 0.05
// context switches per read, ~55 reads per io_uring_enter and per reaper
// wake-up; the pread pool did 34K IOPS at 28 µs and 1.2 switches per read.
// fio (io_uring, QD64) on the same file: 126K IOPS at 7.7 µs per read. At
// QD1 both engines cost ~50 µs and ~1.7-1.9 switches per read: one sleep per
// read is the floor there, plus the Go runtime handing the P of a thread
// blocked in a syscall to another thread.
//
// Both engines give the same contract (see Req and Engine) and pass one test
// suite.
package ioengine
