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
// The io_uring engine instead writes many reads into the submission ring and
// submits them with one io_uring_enter; one reaper goroutine sleeps in
// io_uring_enter until at least one read completes, then takes every
// completion available in that wake-up, calls Done for each, refills the
// ring from its FIFO and submits the refill in the same io_uring_enter it
// sleeps in. The pread engine is the fallback where io_uring is refused
// (kernel.io_uring_disabled, seccomp, old kernels): a fixed pool of
// queueDepth workers, so a burst of requests never becomes a burst of
// goroutines and blocked OS threads.
//
// Both engines give the same contract (see Req and Engine) and pass one test
// suite.
package ioengine
