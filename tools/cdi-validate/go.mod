module mig-operator/tools/cdi-validate

go 1.23

require (
	github.com/opencontainers/runtime-spec v1.3.0
	tags.cncf.io/container-device-interface v1.1.1
)

require (
	github.com/fsnotify/fsnotify v1.7.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/sys v0.19.0 // indirect
	tags.cncf.io/container-device-interface/specs-go v1.1.1 // indirect
)
