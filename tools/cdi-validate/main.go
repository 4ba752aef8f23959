// cdi-validate loads CDI specs with the official CDI library, validates them as a container
// runtime would, applies the named devices to an OCI runtime spec and prints what a container
// would get: its environment, mounts, device nodes, device cgroup rules and hooks, as JSON.
//
//	cdi-validate --cdi-dir /var/run/cdi gpu.cdmo.io/slice=<slice UID> [nvidia.com/gpu=<id> ...]
//	cdi-validate --spec slice.json gpu.cdmo.io/slice=<slice UID>
//
// Exit status: 0 valid and applied; 1 a spec is invalid or a device cannot be applied (the
// reason on stderr); 2 bad usage.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
)

const usageExample = "cdi-validate --cdi-dir /var/run/cdi gpu.cdmo.io/slice=4f9c1e2a-0b7d-4c55-9a7e-2f1d3c4b5a6e"

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// result is what a container started with the applied spec would see.
type result struct {
	Devices      []string                `json:"cdiDevices"`
	Env          []string                `json:"env"`
	Mounts       []oci.Mount             `json:"mounts"`
	DeviceNodes  []oci.LinuxDevice       `json:"deviceNodes"`
	DeviceCgroup []oci.LinuxDeviceCgroup `json:"deviceCgroup"`
	Hooks        *oci.Hooks              `json:"hooks,omitempty"`
	ExtraGIDs    []uint32                `json:"additionalGids,omitempty"`
}

// usageError is bad command-line input (exit 2), as opposed to an invalid spec (exit 1).
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func main() {
	err := run(os.Args[1:], os.Stdout)
	if err == nil {
		return
	}
	fmt.Fprintln(os.Stderr, "cdi-validate:", err)
	var usage usageError
	if errors.As(err, &usage) {
		fmt.Fprintln(os.Stderr, "example:", usageExample)
		os.Exit(2)
	}
	os.Exit(1)
}

func run(args []string, out io.Writer) error {
	var dirs, files stringList
	var ociIn, ociOut string
	fs := flag.NewFlagSet("cdi-validate", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Var(&dirs, "cdi-dir", "directory of CDI spec files (*.json, *.yaml); repeatable")
	fs.Var(&files, "spec", "one CDI spec file; repeatable")
	fs.StringVar(&ociIn, "oci-spec", "", "OCI runtime spec (config.json) to start from; default an empty one")
	fs.StringVar(&ociOut, "oci-out", "", "also write the whole resulting OCI runtime spec to this file")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	devices := fs.Args()
	if len(devices) == 0 {
		return usageError{"no CDI device named"}
	}
	if len(dirs) == 0 && len(files) == 0 {
		return usageError{"give --cdi-dir DIR or --spec FILE"}
	}
	for _, d := range devices {
		if _, _, _, err := parser.ParseQualifiedName(d); err != nil {
			return usageError{fmt.Sprintf("device %q is not a fully-qualified CDI device name (vendor/class=name): %v", d, err)}
		}
	}

	specDirs, cleanup, err := specDirectories(dirs, files)
	if err != nil {
		return err
	}
	defer cleanup()

	// Manual refresh: load once, exactly what is on disk now, as a runtime's cache would.
	cache, _ := cdi.NewCache(cdi.WithSpecDirs(specDirs...), cdi.WithAutoRefresh(false))
	if err := loadErrors(cache); err != nil {
		return err
	}

	spec := &oci.Spec{}
	if ociIn != "" {
		if spec, err = readOCISpec(ociIn); err != nil {
			return err
		}
	}
	if _, err := cache.InjectDevices(spec, devices...); err != nil {
		hint := ""
		if strings.Contains(err.Error(), "failed to stat CDI host device") {
			// The library reads type, major and minor from the host's node when the spec omits them.
			hint = "; a device node absent on this host needs type, major and minor in the spec, " +
				`e.g. {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}`
		}
		return fmt.Errorf("%w (devices known: %s)%s", err, strings.Join(cache.ListDevices(), ", "), hint)
	}
	if ociOut != "" {
		data, err := json.MarshalIndent(spec, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(ociOut, data, 0o644); err != nil {
			return err
		}
	}
	return json.NewEncoder(out).Encode(summarise(spec, devices))
}

// specDirectories returns the directories to load: the given ones, plus a private temporary one
// holding a copy of each --spec file (the library loads specs from directories only).
func specDirectories(dirs, files []string) ([]string, func(), error) {
	for _, d := range dirs {
		if info, err := os.Stat(d); err != nil || !info.IsDir() {
			return nil, nil, usageError{fmt.Sprintf("--cdi-dir %q is not a directory", d)}
		}
	}
	if len(files) == 0 {
		return dirs, func() {}, nil
	}
	tmp, err := os.MkdirTemp("", "cdi-validate-")
	if err != nil {
		return nil, nil, err
	}
	cleanup := func() { os.RemoveAll(tmp) }
	for i, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			cleanup()
			return nil, nil, usageError{fmt.Sprintf("--spec %q: %v", f, err)}
		}
		ext := filepath.Ext(f)
		if ext != ".json" && ext != ".yaml" {
			cleanup()
			return nil, nil, usageError{fmt.Sprintf("--spec %q: a CDI spec file ends in .json or .yaml", f)}
		}
		// Numbered so that two files of one name from different directories both load.
		name := fmt.Sprintf("%03d-%s", i, filepath.Base(f))
		if err := os.WriteFile(filepath.Join(tmp, name), data, 0o600); err != nil {
			cleanup()
			return nil, nil, err
		}
	}
	return append(slices.Clone(dirs), tmp), cleanup, nil
}

// loadErrors collects every error the cache met: unreadable directories, specs that fail to
// parse or validate, and devices defined twice. Any of them fails the run, stricter than a
// runtime (which skips a bad spec and uses the rest), because a spec we wrote must be clean.
func loadErrors(cache *cdi.Cache) error {
	var msgs []string
	for dir, err := range cache.GetSpecDirErrors() {
		msgs = append(msgs, fmt.Sprintf("%s: %v", dir, err))
	}
	for path, errs := range cache.GetErrors() {
		for _, err := range errs {
			msgs = append(msgs, fmt.Sprintf("%s: %v", path, err))
		}
	}
	if len(msgs) == 0 {
		return nil
	}
	slices.Sort(msgs)
	return errors.New("invalid CDI spec:\n  " + strings.Join(msgs, "\n  "))
}

func readOCISpec(path string) (*oci.Spec, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, usageError{fmt.Sprintf("--oci-spec %q: %v", path, err)}
	}
	spec := &oci.Spec{}
	if err := json.Unmarshal(data, spec); err != nil {
		return nil, usageError{fmt.Sprintf("--oci-spec %q is not an OCI runtime spec: %v", path, err)}
	}
	return spec, nil
}

func summarise(spec *oci.Spec, devices []string) result {
	// Empty lists, not null, so a reader can iterate without checks.
	r := result{Devices: devices, Env: []string{}, Mounts: spec.Mounts, Hooks: spec.Hooks}
	if r.Mounts == nil {
		r.Mounts = []oci.Mount{}
	}
	if spec.Process != nil {
		r.Env = append(r.Env, spec.Process.Env...)
		r.ExtraGIDs = spec.Process.User.AdditionalGids
	}
	r.DeviceNodes = []oci.LinuxDevice{}
	r.DeviceCgroup = []oci.LinuxDeviceCgroup{}
	if spec.Linux != nil {
		r.DeviceNodes = append(r.DeviceNodes, spec.Linux.Devices...)
		if spec.Linux.Resources != nil {
			r.DeviceCgroup = append(r.DeviceCgroup, spec.Linux.Resources.Devices...)
		}
	}
	return r
}
