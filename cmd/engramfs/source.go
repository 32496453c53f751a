package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	units "github.com/docker/go-units"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/ioengine"
	"github.com/engramfs/engramfs/backing/s3source"
	"github.com/engramfs/engramfs/internal/stats"
)

// s3Flags are the settings of an s3://bucket/prefix MODEL_DIR. Credentials
// come from the standard AWS environment (AWS_ACCESS_KEY_ID,
// AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, ...), never from
// flags, and are never logged.
type s3Flags struct {
	s3Endpoint  string
	s3Region    string
	s3PathStyle optionalBool
	// The local SSD mirror of fetched pages.
	s3Mirror     string
	s3MirrorSize string
	s3FillRate   string
	// How long a GET may take, and may go without progress.
	s3AttemptTimeout string
	s3StallTimeout   string
}

func (f *s3Flags) register(fl interface {
	StringVar(*string, string, string, string)
	Var(flag.Value, string, string)
}) {
	fl.StringVar(&f.s3Endpoint, "s3-endpoint", "",
		"s3:// MODEL_DIR: the object store's URL, e.g. http://10.0.0.5:7070 for Ceph RGW, MinIO, SeaweedFS, versitygw (default: AWS S3, or $AWS_ENDPOINT_URL)")
	fl.StringVar(&f.s3Region, "s3-region", "", "s3:// MODEL_DIR: the bucket's region (default: $AWS_REGION, else us-east-1)")
	fl.Var(&f.s3PathStyle, "s3-path-style",
		"s3:// MODEL_DIR: address buckets as ENDPOINT/bucket/key instead of bucket.ENDPOINT/key (default: true when --s3-endpoint is given)")
	fl.StringVar(&f.s3Mirror, "s3-mirror", "",
		"s3:// MODEL_DIR: a local (SSD) directory that mirrors the pages fetched, kept across mounts; needs --s3-mirror-size")
	fl.StringVar(&f.s3MirrorSize, "s3-mirror-size", "",
		"s3:// MODEL_DIR: the most bytes --s3-mirror holds, e.g. 100GiB (least recently used 2 MiB extents are punched out)")
	fl.StringVar(&f.s3FillRate, "s3-fill-rate", "",
		"s3:// MODEL_DIR: copy the shards' pages not mirrored yet into --s3-mirror in the background at most this many bytes a second, e.g. 50MiB, in GET slots no read waits for, until the mirror is full (default 0: off)")
	fl.StringVar(&f.s3AttemptTimeout, "s3-attempt-timeout", "",
		"s3:// MODEL_DIR: the longest one GET may take, body included, before it is retried, e.g. 10s (default 30s)")
	fl.StringVar(&f.s3StallTimeout, "s3-stall-timeout", "",
		"s3:// MODEL_DIR: the longest a GET may wait for its answer, then for each next byte of its body, before it is given up and retried, e.g. 1s (default 2s)")
}

// timeouts reads --s3-attempt-timeout and --s3-stall-timeout into cfg.
func (f *s3Flags) timeouts(cfg *s3source.Config) error {
	for _, d := range []struct {
		flag, value string
		to          *time.Duration
	}{
		{"--s3-attempt-timeout", f.s3AttemptTimeout, &cfg.AttemptTimeout},
		{"--s3-stall-timeout", f.s3StallTimeout, &cfg.StallTimeout},
	} {
		if d.value == "" {
			continue
		}
		v, err := time.ParseDuration(d.value)
		if err != nil || v <= 0 {
			return usagef("%s %q: want a duration such as 10s or 500ms", d.flag, d.value)
		}
		*d.to = v
	}
	if cfg.StallTimeout > cfg.AttemptTimeout {
		return usagef("--s3-stall-timeout %v is longer than --s3-attempt-timeout %v: it would never apply", cfg.StallTimeout, cfg.AttemptTimeout)
	}
	return nil
}

// mirrorConfig reads --s3-mirror, --s3-mirror-size and --s3-fill-rate.
func (f *s3Flags) mirrorConfig() (s3source.MirrorConfig, error) {
	var rate int64
	if f.s3FillRate != "" {
		r, err := units.RAMInBytes(f.s3FillRate)
		if err != nil || r < 0 {
			return s3source.MirrorConfig{}, usagef("--s3-fill-rate %q: want bytes a second, such as 50MiB (0: off)", f.s3FillRate)
		}
		rate = r
	}
	switch {
	case rate > 0 && f.s3Mirror == "":
		return s3source.MirrorConfig{}, usagef("--s3-fill-rate needs --s3-mirror DIR: it fills the mirror")
	case f.s3Mirror == "" && f.s3MirrorSize == "":
		return s3source.MirrorConfig{}, nil
	case f.s3Mirror == "":
		return s3source.MirrorConfig{}, usagef("--s3-mirror-size needs --s3-mirror DIR")
	case f.s3MirrorSize == "":
		return s3source.MirrorConfig{}, usagef("--s3-mirror needs --s3-mirror-size, e.g. 100GiB")
	}
	size, err := units.RAMInBytes(f.s3MirrorSize)
	if err != nil || size < s3source.MirrorExtent {
		return s3source.MirrorConfig{}, usagef("--s3-mirror-size %q: want a size of at least 2MiB, such as 100GiB", f.s3MirrorSize)
	}
	return s3source.MirrorConfig{Dir: f.s3Mirror, Size: size, FillRate: rate}, nil
}

// optionalBool is a boolean flag that knows whether it was given.
type optionalBool struct {
	set, value bool
}

func (b *optionalBool) String() string {
	if b == nil || !b.set {
		return ""
	}
	return strconv.FormatBool(b.value)
}

func (b *optionalBool) Set(s string) error {
	v, err := strconv.ParseBool(s)
	if err != nil {
		return err
	}
	b.set, b.value = true, v
	return nil
}

func (b *optionalBool) IsBoolFlag() bool { return true }

// openSource opens MODEL_DIR: an object store prefix (s3://bucket/prefix),
// or a local or NFS directory whose shards engine reads.
func openSource(arg string, mf mountFlags, engine ioengine.Engine, st *stats.Counters, log *zap.Logger) (backing.Source, error) {
	if !s3source.IsURL(arg) {
		if mf.s3Endpoint != "" || mf.s3Region != "" || mf.s3PathStyle.set || mf.s3Mirror != "" || mf.s3MirrorSize != "" || mf.s3FillRate != "" ||
			mf.s3AttemptTimeout != "" || mf.s3StallTimeout != "" {
			return nil, usagef("--s3-* flags apply only to an s3://bucket/prefix MODEL_DIR, not %s", arg)
		}
		mode, err := backing.ParseIOMode(mf.backingIO)
		if err != nil {
			return nil, usageError{Err: err}
		}
		fi, err := os.Stat(arg)
		if err != nil {
			return nil, fmt.Errorf("model directory: %w", err)
		}
		if !fi.IsDir() {
			return nil, fmt.Errorf("model directory %s: not a directory", arg)
		}
		return backing.NewLocalSource(arg, mode, engine, st), nil
	}
	if _, _, err := s3source.ParseURL(arg); err != nil {
		return nil, usageError{Err: err}
	}
	cfg := s3source.DefaultConfig()
	cfg.Concurrency = mf.queueDepth
	cfg.Client = s3source.ClientConfig{Endpoint: mf.s3Endpoint, Region: mf.s3Region, PathStyle: mf.s3Endpoint != ""}
	if mf.s3PathStyle.set {
		cfg.Client.PathStyle = mf.s3PathStyle.value
	}
	if err := mf.timeouts(&cfg); err != nil {
		return nil, err
	}
	mirror, err := mf.mirrorConfig()
	if err != nil {
		return nil, err
	}
	cfg.Mirror = mirror
	cfg.Mirror.Engine = engine // mirrored pages are read as local shards are
	cfg.Mirror.Log = log
	st.ReadEngine = "s3"
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return s3source.New(ctx, arg, cfg, st)
}

// logSource logs, once a mount's shards are open, what its source does
// differently from what was asked: an object store mirror on a filesystem
// without O_DIRECT (tmpfs) reads its pages through the page cache.
func logSource(source backing.Source, log *zap.Logger) {
	if s, ok := source.(*s3source.Source); ok {
		if why := s.MirrorBuffered(); why != "" {
			log.Warn("s3 mirror: no O_DIRECT on its filesystem: mirrored pages are read through the page cache",
				zap.String("mirror", s.Mirror().Dir), zap.String("reason", why))
		}
	}
}
